"""``python -m distllm``: the ``distllm`` command.

The folder ``-m`` puts first on ``sys.path``, the working directory, is taken off it first:
in a checkout of distllm that is the repo's root, whose top-level ``kernels/`` and ``bench/``
(installed as ``distllm.kernels`` and ``distllm.bench``) would also import as top-level
``kernels`` and ``bench``, shadowing installed packages of those names: transformers imports
Hugging Face's ``kernels`` when it is installed (recent transformers depend on it), and
``--init-from`` failed in ranks started from the root. distllm itself is imported by then.
"""

import os
import sys

if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from distllm.cli import main  # noqa: E402

raise SystemExit(main())
