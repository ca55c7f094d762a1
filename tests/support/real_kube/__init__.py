"""A real Kubernetes control plane (etcd, kube-apiserver) for tests; see `control_plane`."""

from .control_plane import ISSUER, ControlPlaneError, RealControlPlane
from .rbac import AppliedRbac, apply_deploy_rbac

__all__ = ["ISSUER", "AppliedRbac", "ControlPlaneError", "RealControlPlane", "apply_deploy_rbac"]
