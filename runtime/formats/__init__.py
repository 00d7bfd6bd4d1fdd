"""Reading models from files: GGUF and safetensors readers, checkpoints, drafter formats, tokenizers."""
