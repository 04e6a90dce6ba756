"""Tools over everything below: `tpu-llm doctor` (doctor.py), `bench` (bench.py), `plan` (plan.py),
XLA's memory measurement (xla_memory.py) and the config reference page (config_reference.py)."""
