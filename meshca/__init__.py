"""meshca's program shell: the `meshca` command line and the runtime helpers both daemons share
(clock, durations, atomic files, logging). The PKI lives in `certs`, the daemons in `ca_server`
and `agent`."""
