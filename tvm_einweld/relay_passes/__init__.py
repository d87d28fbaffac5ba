"""relay_passes"""
