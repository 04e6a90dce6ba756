"""Tools over everything below: `tpu-llm doctor` (doctor/, one module per family of checks), `bench` (bench.py;
its memory and data suites in bench_memory.py and bench_data.py), `plan` (plan.py) and the config reference
page (config_reference.py). The offline compile harness they use is tpu_llm/harness/."""
