"""meshca's two outer floors.

- The runtime layer (every module here except `cli`, `__main__` and `commands/`): clock,
  durations, atomic files, logging, status HTTP, Prometheus name aliases, the Kubernetes
  informer and API-client builder, pod facts and service-account name parsing, and gRPC
  service registration with the one lenient request decoder (`grpc_services`). Both daemons
  build on it; it imports only `certs` and third-party libraries.
- The command line (`cli`, `commands/`): above `ca_server` and `agent`, it turns flags into each
  program's typed configuration and runs it.

The PKI lives in `certs`, the daemons in `ca_server` and `agent`; `tests/test_layers.py` keeps
the floors apart.
"""
