"""Build step that pyproject.toml cannot express: `focus_hf.pth` goes to the root of site-packages.

Python runs the `.pth` line at interpreter start (`focus_hf_autoload.install`: Focus is registered with PEFT once
peft is imported). Everything else about the package is declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_FILE = "focus_hf.pth"


class BuildPyWithPth(build_py):
    """`build_py`, plus the `.pth` file at the root of what is installed.

    A wheel installs the build folder's root into site-packages. An editable install (PEP 660) installs only what
    setuptools puts into its editable wheel, whose root is the install command's `install_lib` folder.
    """

    def run(self) -> None:
        super().run()
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(str(Path(__file__).resolve().parent / PTH_FILE), str(Path(root) / PTH_FILE))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib) / PTH_FILE)]


setup(cmdclass={"build_py": BuildPyWithPth})
