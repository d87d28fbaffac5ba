"""auto_scheduler_ext"""
