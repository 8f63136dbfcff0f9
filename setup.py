"""The packages are found, not listed: the runtime's source folder is runtime/ and its import
name ftpipe_runtime (setup.cfg's package_dir), which setuptools' own finder cannot map. The
rest of the metadata is in setup.cfg."""

from setuptools import find_packages, setup

FOLDERS = {  # import name -> source folder
    "ftpipe_compiler": "ftpipe_compiler",
    "ftpipe_runtime": "runtime",
}
DATA = ["ftpipe_compiler._configs", "ftpipe_compiler._templates"]  # configs/, templates/


def packages() -> list[str]:
    found = [f"{name}.{p}" for name, folder in FOLDERS.items() for p in find_packages(folder)]
    return [*FOLDERS, *sorted(found), *DATA]


if __name__ == "__main__":
    setup(packages=packages())
