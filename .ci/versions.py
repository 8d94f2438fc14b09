"""Print the resolved versions of the dependencies whose new releases have broken ladle before."""

from importlib.metadata import PackageNotFoundError, version

NAMES = ("torch", "transformers", "kernels", "xgrammar", "pyarrow", "datasets", "hydra-core", "ray",
         "triton", "numpy")

for name in NAMES:
    try:
        print(f"{name:14} {version(name)}")
    except PackageNotFoundError:
        print(f"{name:14} (not installed)")
