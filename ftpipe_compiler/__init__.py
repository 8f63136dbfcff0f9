"""ftpipe's compiler: model -> graph -> costs -> problem -> plans -> simulation -> package.

Importing it loads nothing heavy: `ftpipe --help` and `ftpipe models` run without torch. The
`ftpipe` command applies the runtime's process settings (`ftpipe_runtime.prepare_process`)
before a command loads torch, so a measured profile times its operators as the package's
ranks will run them.
"""
