"""`python -m runner` from a checkout of ladle: the same entry as `ladle` and `python -m ladle`.

This folder has no __init__.py on purpose: it is a namespace package, so it never shadows another
distribution's `runner` module, and it is not installed (the package is `ladle`, under ladle/).
"""

from ladle.runner.__main__ import main

if __name__ == "__main__":
    main()
