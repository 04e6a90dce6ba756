"""Parallelism as configuration: the strategy and device placement (distribute.py), the TPU connection
(tpu.py), local clusters (launch.py), the gradient exchange (comm.py: compression, local SGD), GPipe
stages (pipeline.py) and tensor groups (tensor.py). The model never asks which strategy it runs under."""
