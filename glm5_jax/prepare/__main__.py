"""`python -m glm5_jax.prepare`: see glm5_jax/prepare/cli.py."""

from glm5_jax.prepare.cli import run

if __name__ == "__main__":
    run()
