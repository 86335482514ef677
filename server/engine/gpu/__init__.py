"""CuPy + cuDNN frontend GPU engine."""
