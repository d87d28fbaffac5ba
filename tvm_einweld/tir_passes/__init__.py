"""tir_passes"""
