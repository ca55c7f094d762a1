"""The `meshca` subcommands, one module each, above the runtime layer and both daemons.

Every command's module (named for the command) has the same two parts, so `meshca.cli` (which
keeps each command's one-line help itself) can load only the one that runs:
- `add_arguments(parser)`: registers the command's flags;
- `run(args) -> int`: builds the command's typed configuration with
  `<Config>.from_args(args, os.environ)` (the only place a command reads the environment),
  runs it, and returns the exit status (2: the operator must fix a flag or variable).

A command's helpers sit beside it, named for it: `authority_view` (the slots read and drawn,
for `authority` and `status`), `authority_agents` (`authority show --agents`); `status_fetch`
(an address or the shared state → one snapshot) and `status_render` (a snapshot → a table or
JSON).

Each module imports its daemon lazily enough that `meshca agent` never imports `ca_server` or
`kubernetes` unless node mode watches pods.
"""
