"""The `meshca` subcommands, one module each, above the runtime layer and both daemons.

Every module has the same two parts, so `meshca.cli` (which keeps each command's one-line help
itself) can load only the one that runs:
- `add_arguments(parser)`: registers the command's flags;
- `run(args) -> int`: builds the command's typed configuration with
  `<Config>.from_args(args, os.environ)` (the only place a command reads the environment),
  runs it, and returns the exit status (2: the operator must fix a flag or variable).

Each module imports its daemon lazily enough that `meshca agent` never imports `ca_server` or
`kubernetes` unless node mode watches pods.
"""
