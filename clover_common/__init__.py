"""What the base install and the PyTorch reference share, torch-free: errors and the one-line CLI runner, safe
output files, the model config and its block-diffusion settings, the Hugging Face tensor layout, safetensors
headers, the tokenizer, chat rendering and the generate output schema."""
