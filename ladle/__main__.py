"""`python -m ladle`: the same entry as the `ladle` command (ladle/runner/__main__.py)."""

from ladle.runner.__main__ import main

if __name__ == "__main__":
    main()
