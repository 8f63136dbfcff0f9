"""ftpipe's compiler: model -> graph -> costs -> problem -> plans -> simulation -> package.

The runtime is imported first so that torch, loaded after it, puts large CPU tensors on
huge pages (`ftpipe_runtime.job.cpu_allocator`): a measured profile then times its operators
as the package's ranks will run them.
"""

import ftpipe_runtime  # noqa: F401 - before torch
