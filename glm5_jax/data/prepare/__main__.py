"""`python -m glm5_jax.data.prepare`: see glm5_jax/data/prepare/cli.py."""

from glm5_jax.data.prepare.cli import run

if __name__ == "__main__":
    run()
