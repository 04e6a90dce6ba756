"""The wider ecosystem: Hugging Face checkpoints in and out (hf.py, reading and writing safetensors with
safetensors_io.py) and SavedModel export (export.py)."""
