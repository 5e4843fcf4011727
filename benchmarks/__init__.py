"""Side-by-side measurements of the framework against plain PyTorch and plain Lightning."""
