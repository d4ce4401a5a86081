"""`configs/demo.py` trained on the prepare pipeline's output instead of the raw standard library:
the same model, optimizer, steps, seed and validation fraction, only `data.sources` differs.

    python -m glm5_jax.prepare --config configs/data/demo.py --output data/prepared/demo
    python train.py --config configs/demo.py --workdir runs/demo_raw
    python train.py --config configs/demo_prepared.py:data/prepared/demo --workdir runs/demo_prepared \
        --config.data.tokenizer_path=runs/demo_raw/tokenizer.json

The argument names the prepared directory (default data/prepared/demo). Give the raw run's
tokenizer, so both models see the same tokens (a tokenizer trained on the prepared text would
differ slightly). Prepared documents keep their raw ids, so the train/validation split by id
hash puts each on the side its raw original is on (docs/data.md, "Prepared vs raw data").
"""

from pathlib import Path

import ml_collections

from glm5_jax.config_files import load_config_file


def get_config(prepared_dir: str = "data/prepared/demo") -> ml_collections.ConfigDict:
    config = load_config_file(Path(__file__).with_name("demo.py"))
    config.data.sources = [dict(kind="prepared", name="prepared", weight=1.0, paths=[prepared_dir])]
    return config
