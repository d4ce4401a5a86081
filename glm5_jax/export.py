"""Export a train.py run to the Hugging Face layout (safetensors + config.json + tokenizer.json).

    python -m glm5_jax.export --workdir runs/demo --output exported/demo
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from absl import logging

from glm5_jax.checkpoint import save_pretrained
from glm5_jax.train.runs import RunNotFoundError, load_run


def export_run(workdir: str, output: str, max_shard_size: str = "5GB") -> Path:
    config, params = load_run(workdir)
    save_pretrained(config, params, output, max_shard_size=max_shard_size)
    for name in ("tokenizer.json", "chat_template.jinja", "tokenizer_config.json"):  # the chat template
        if (Path(workdir) / name).exists():                                             # of a fine-tuned run
            shutil.copyfile(Path(workdir) / name, Path(output) / name)
    return Path(output)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="train.py run directory")
    parser.add_argument("--output", required=True, help="directory to write the HF checkpoint to")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 2GB")
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.ERROR)  # orbax narrates each checkpoint it opens and reads
    try:  # the run's newest usable checkpoint (damaged newer steps named and skipped)
        output = export_run(args.workdir, args.output, args.max_shard_size)
    except RunNotFoundError as error:
        raise SystemExit(f"error: {error}") from None
    print(f"exported to {output}")


if __name__ == "__main__":
    main()
