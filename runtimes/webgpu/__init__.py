"""Run ExecuTorch programs lowered for WebGPU (VulkanBackend payloads) without executorch."""
