"""`python -m glm5_jax.evaluate`: see glm5_jax/evaluate/cli.py."""

import sys

from glm5_jax.evaluate.cli import main

if __name__ == "__main__":
    sys.exit(main())
