"""How the CA serves: `cq_server`, its gRPC server on grpcio's completion queue."""
