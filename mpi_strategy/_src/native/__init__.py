"""The native engine: the hot collectives as compiled TensorFlow kernels (TF's C API)."""
