"""Data: where the text or shards are (sources.py, with the shipped corpora in corpora.py), the input
pipeline that tokenizes, packs and batches them per host (dataset.py, with reading.py, lanes.py and
input_checks.py), and `tpu-llm data prepare`, which writes pre-tokenized TFRecord shards (prepare.py)."""
