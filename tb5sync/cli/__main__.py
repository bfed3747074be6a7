"""``python -m tb5sync.cli``: the tb5sync command."""

from tb5sync.cli.command import run

if __name__ == "__main__":
    run()
