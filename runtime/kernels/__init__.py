"""What runs the math fast: the C++ CPU kernels and their quantized blocks, the compiled step, the fused Triton Markov
kernel, the device choice."""
