"""meshca as a Kubernetes Pod Certificate signer (`--pod-certificate-signer`, KEP-4317;
docs/pod-certificates.md).

The kubelet makes a pod's key, asks for its certificate with a PodCertificateRequest naming a
signer, and mounts what the signer writes in the request's status. This package is that
signer, one module per job:
- `requests`: what is kept of a request (raw JSON → a compact value; answered ones shared);
- `checks`: whether a request may be signed — the key type, and the pod it names against the
  CA's pod cache (pure);
- `timing`: the leaf's lifetime and `beginRefreshAt` within the API's bounds (pure);
- `status`: the one status update's body;
- `signer`: the watch, the Lease gate and the thread that decides, signs and writes.

`ca_server.kube.mode.KubernetesMode` builds the signer when the flag is set; the server hands it
the CA's signer, TTL policy and planned handover once the authority driver has started.
"""

from ca_server.kube.pod_certificates.signer import PodCertificateSigner

__all__ = ["PodCertificateSigner"]
