"""Max |logit error| against transformers' GlmMoeDsaForCausalLM for every parity variant.

    python bench/parity.py        (prints a Markdown table; needs the [test] extra)
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from test_parity import VARIANTS, check_parity  # noqa: E402

from glm5_jax.config_files import load_model_config  # noqa: E402


def main():
    tiny = load_model_config("configs/tiny.py", num_mtp_layers=0)
    cases = [(name, tiny.replace(**changes), 24, 2, 1) for name, changes in sorted(VARIANTS.items())]
    cases.append(("odd_length_17", tiny, 17, 3, 2))
    print("| variant | batch x length | max abs logit error | smallest top-k boundary gap |")
    print("|---|---|---|---|")
    for name, config, length, batch, seed in cases:
        with tempfile.TemporaryDirectory() as directory:
            error, gap = check_parity(config, Path(directory), seq_len=length, batch=batch,
                                      seed=seed)
        print(f"| {name} | {batch} x {length} | {error:.2e} | {gap:.2e} |", flush=True)


if __name__ == "__main__":
    main()
