"""CUDA kernels: sources (*.cu, *.cuh) and their build (build.py)."""
