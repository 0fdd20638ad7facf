"""The model: config, layers, weight loading, the packed forward batch, the Llama-family forward."""
