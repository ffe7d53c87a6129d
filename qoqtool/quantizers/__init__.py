"""quantizers"""
