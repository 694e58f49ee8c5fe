"""Readers and writers of the files a target gets: ExecuTorch's .pte (a flatbuffer), the Vulkan
delegate's payload inside it, and the bundle that carries an artifact with its goldens."""
