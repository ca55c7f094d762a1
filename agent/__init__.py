"""The meshca agent: gets a workload its identity from the CA, keeps it fresh, and hands it to
Envoy (SDS over a Unix socket) and to applications (files)."""
