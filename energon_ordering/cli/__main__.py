"""``python -m energon_ordering.cli``: the same as the ``energon-ordering`` command."""

from energon_ordering.cli import main

if __name__ == "__main__":
    main()
