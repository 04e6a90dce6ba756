"""Google Cloud: the Cloud Storage helpers (storage.py, with gcs.py and preflight.py) and the Cloud TPU
driver that the Makefile runs as `python -m tpu_llm.cloud up|down|status|train|...` (driver.py, made of
base.py, provision.py, launch.py and watch.py, with shell.py, worker_plan.py and lock.py). Nothing here
imports TensorFlow; the driver needs only the standard library."""
