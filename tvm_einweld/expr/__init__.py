"""expr"""
