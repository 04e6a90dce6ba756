"""`tpu-llm generate`'s flags, each checked before TensorFlow loads (seconds, where loading a model takes
a minute): the prompt from --prompt or --prompt_file (UTF-8, bounded), the sampling bounds (the
config's, config.CAPS: `generate` and a run's samples accept the same values), beam search's, and
--run_dir. Apart from commands.py, which holds the commands, because they are a concern of their own:
a dozen refusals, each one line naming the flag.
"""

from __future__ import annotations

import math
import os

from tpu_llm.config import CAPS, EARLY_STOPPING, INT64, MAX_BEAMS, MAX_LENGTH_PENALTY, MAX_NEW_TOKENS, MAX_SAMPLES
from tpu_llm.errors import UserError
from tpu_llm.platform import files
from tpu_llm.platform.run_layout import CONFIG_FILE

MAX_PROMPT_BYTES = 16 << 20  # far beyond any model's context (128k tokens are ~0.5 MB of text)


def read_prompt(prompt: str, prompt_file: str) -> str:
    """The prompt: --prompt, or the text of --prompt_file (UTF-8, a byte-order mark dropped)."""
    if not prompt_file:
        return prompt  # (the parser refused one that is not UTF-8)
    if prompt:
        raise UserError("give --prompt or --prompt_file, not both")
    try:  # a regular file only, at most MAX_PROMPT_BYTES read (/dev/zero or a FIFO is refused, not read)
        data = files.read_regular(prompt_file, MAX_PROMPT_BYTES, "--prompt_file",
                                  "far longer than any model's context; give the end of the text",
                                  follow_links=True)
    except FileNotFoundError as e:
        raise UserError(f"--prompt_file {prompt_file} cannot be read ({e.strerror or e}); give a UTF-8 text file "
                        "on this machine") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompt_file {prompt_file} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                        f"{e.start}); convert it to UTF-8 first (e.g. iconv -f latin1 -t utf-8)") from None
    return text.removeprefix("\ufeff")


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
                   num_samples: int) -> None:
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max_new_tokens={max_new_tokens} must be between 1 and {MAX_NEW_TOKENS:,}: each token is "
                        "one step of the model (a million already take hours)")
    if not 1 <= num_samples <= MAX_SAMPLES:
        raise UserError(f"--num_samples={num_samples} must be between 1 and {MAX_SAMPLES:,}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"--temperature={temperature} must be a finite number >= 0 (0 = greedy; 0.7-1.0 is usual)")
    if not 0 < top_p <= 1:  # (nan fails too)
        raise UserError(f"--top_p={top_p} must be in (0, 1] (1.0 = off)")
    if not 0 <= top_k <= CAPS["sample.top_k"][0]:
        raise UserError(f"--top_k={top_k} must be >= 0 (0 = off) and at most {CAPS['sample.top_k'][0]:,}")
    if not -INT64 <= seed <= CAPS["sample.seed"][0]:  # sample i draws with seed + i, a 64-bit integer
        raise UserError(f"--seed={seed} must fit in 64 bits (-2**63 to 2**63 - 1 - {MAX_SAMPLES:,}): sample i draws "
                        "with seed + i")


def check_beams(num_beams: int, length_penalty: float, early_stopping: str, num_return_sequences: int,
                temperature: float, num_samples: int) -> None:
    if not 1 <= num_beams <= MAX_BEAMS:
        raise UserError(f"--num_beams={num_beams} must be between 1 (off: sample) and {MAX_BEAMS}: each beam is a row "
                        "of the KV cache")
    if not abs(length_penalty) <= MAX_LENGTH_PENALTY:  # NaN and infinity fail too
        raise UserError(f"--length_penalty={length_penalty} must be between -{MAX_LENGTH_PENALTY:g} and "
                        f"{MAX_LENGTH_PENALTY:g}: a beam scores sum(log p) / length ** it, in float32 (1.0 = the mean "
                        "log-probability)")
    if early_stopping not in EARLY_STOPPING:
        raise UserError(f"--early_stopping={early_stopping!r}; valid choices: {', '.join(EARLY_STOPPING)}")
    if not 1 <= num_return_sequences <= num_beams:
        raise UserError(f"--num_return_sequences={num_return_sequences} must be between 1 and --num_beams="
                        f"{num_beams}: the best of the beams are printed")
    if num_beams > 1 and temperature != 0:
        raise UserError(f"--num_beams={num_beams} searches greedily: add --temperature 0 (not {temperature}; beam "
                        "sampling is not supported)")
    if num_beams > 1 and num_samples > 1:
        raise UserError(f"--num_samples={num_samples} with --num_beams={num_beams}: beam search is deterministic, "
                        "every sample would be the same; use --num_return_sequences for several beams")


def check_run_dir(run_dir: str) -> None:
    """--run_dir holds a run (its config.yaml; a gs:// one is checked when it is read)."""
    if "://" not in run_dir and not os.path.isfile(os.path.join(run_dir, CONFIG_FILE)):
        raise UserError(f"{run_dir!r} is not a run directory (no config.yaml/tokenizer.json); "
                        "pass the --run_dir of a `tpu-llm train` run")
