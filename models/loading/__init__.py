"""Loading weights: GGUF and safetensors files, the conversion cache, load-time checks."""
