"""The CPU path's native parts: the C++ kernels (built on first use) and huge-page placement."""
