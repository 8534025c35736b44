"""KServe's ServingRuntime and InferenceService, as JSON Schemas of the fields gepool's manifests use.

No pip package ships KServe's CRD schemas, and KServe's files are not copied here: these were written
from the OpenAPI schemas in kserve/kserve at commit aaac4e294dae2c7b1aa1886447793f3aa1c30912,
``config/crd/full/serving.kserve.io_servingruntimes.yaml`` (v1alpha1) and
``config/crd/full/serving.kserve.io_inferenceservices.yaml`` (v1beta1): the same required fields, types
and enums, and the protocol names of ``pkg/constants/constants.go`` (``InferenceServiceProtocol``), which
the CRD types only as strings. Two things are stricter than the CRD, on purpose:

- an unknown field is refused (``additionalProperties: false``): the API server would prune it
  silently, and a setting dropped without a word is what these tests are here to catch;
- the Kubernetes parts (containers, volumes, tolerations, pod fields) are checked by
  ``kubernetes-validate`` as the Pod they become (``pod_of_runtime``, ``pod_of_predictor``).
"""

import copy

PROTOCOLS = ["v1", "v2", "grpc-v1", "grpc-v2"]  # pkg/constants/constants.go, InferenceServiceProtocol

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_INT32 = {"type": "integer", "minimum": -(1 << 31), "maximum": (1 << 31) - 1}
_INT64 = {"type": "integer"}
_OBJECTS = {"type": "array", "items": {"type": "object"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STRING_MAP,
                   "annotations": _STRING_MAP},
    "additionalProperties": False,
}

# ServingRuntimeSpec: spec.required = [containers]; supportedModelFormats[].required = [name],
# priority int32 >= 1; containers[] and volumes[] require a name (the rest: core v1, checked as a Pod)
_POD_FIELDS_OF_RUNTIME = ("containers", "volumes", "nodeSelector", "tolerations", "affinity", "imagePullSecrets",
                          "schedulerName", "hostIPC")
SERVING_RUNTIME = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "serving.kserve.io/v1alpha1"},
        "kind": {"const": "ServingRuntime"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {
                "annotations": _STRING_MAP,
                "labels": _STRING_MAP,
                "supportedModelFormats": {"type": "array", "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                   "autoSelect": {"type": "boolean"}, "priority": {**_INT32, "minimum": 1}},
                    "additionalProperties": False,
                }},
                "protocolVersions": {"type": "array", "items": {"enum": PROTOCOLS}},
                "multiModel": {"type": "boolean"},
                "disabled": {"type": "boolean"},
                "replicas": _INT32,
                "grpcEndpoint": {"type": "string"},
                "grpcDataEndpoint": {"type": "string"},
                "httpDataEndpoint": {"type": "string"},
                "containers": {"type": "array", "minItems": 1,
                               "items": {"type": "object", "required": ["name"]}},
                "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                "nodeSelector": _STRING_MAP,
                "tolerations": _OBJECTS,
                "affinity": {"type": "object"},
                "imagePullSecrets": _OBJECTS,
                "schedulerName": {"type": "string"},
                "hostIPC": {"type": "boolean"},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}

# InferenceService: spec.required = [predictor]; predictor = PodSpec fields + ComponentExtensionSpec
# (minReplicas, maxReplicas int32; scaleMetric enum; scaleTarget int32; ...) + model, which is a core
# Container plus modelFormat (required name), runtime, runtimeVersion, protocolVersion, storageUri
_MODEL_FIELDS = {"modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri"}
_POD_FIELDS_OF_PREDICTOR = ("terminationGracePeriodSeconds", "nodeSelector", "tolerations", "affinity", "volumes",
                            "imagePullSecrets", "serviceAccountName", "securityContext", "priorityClassName",
                            "containers")
INFERENCE_SERVICE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["predictor"],
            "properties": {"predictor": {
                "type": "object",
                "properties": {
                    "minReplicas": _INT32,
                    "maxReplicas": _INT32,
                    "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]},
                    "scaleTarget": _INT32,
                    "containerConcurrency": _INT64,
                    "timeout": _INT64,
                    "canaryTrafficPercent": _INT64,
                    "labels": _STRING_MAP,
                    "annotations": _STRING_MAP,
                    "terminationGracePeriodSeconds": _INT64,
                    "nodeSelector": _STRING_MAP,
                    "tolerations": _OBJECTS,
                    "affinity": {"type": "object"},
                    "volumes": _OBJECTS,
                    "imagePullSecrets": _OBJECTS,
                    "serviceAccountName": {"type": "string"},
                    "securityContext": {"type": "object"},
                    "priorityClassName": {"type": "string"},
                    "containers": _OBJECTS,
                    "model": {
                        "type": "object",
                        "required": ["modelFormat"],
                        "properties": {
                            "modelFormat": {"type": "object", "required": ["name"],
                                            "properties": {"name": {"type": "string"}, "version": {"type": "string"}},
                                            "additionalProperties": False},
                            "runtime": {"type": "string"},
                            "runtimeVersion": {"type": "string"},
                            "protocolVersion": {"enum": PROTOCOLS},
                            "storageUri": {"type": "string"},
                        },
                        # anything else in model is a core Container field, checked as one by pod_of_predictor
                    },
                },
                "additionalProperties": False,
            }},
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}


def pod_of_runtime(runtime: dict) -> dict:
    """The Pod a ServingRuntime's pod fields make, for kubernetes-validate."""
    spec = runtime["spec"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": runtime["metadata"]["name"]},
            "spec": {k: copy.deepcopy(spec[k]) for k in _POD_FIELDS_OF_RUNTIME if k in spec}}


def pod_of_predictor(isvc: dict) -> dict:
    """The Pod an InferenceService's predictor makes: its pod fields, and its model as a core Container
    (KServe names it kserve-container) without KServe's own fields."""
    predictor = isvc["spec"]["predictor"]
    spec = {k: copy.deepcopy(predictor[k]) for k in _POD_FIELDS_OF_PREDICTOR if k in predictor}
    container = {k: v for k, v in predictor.get("model", {}).items() if k not in _MODEL_FIELDS}
    spec["containers"] = [*spec.get("containers", []), {"name": "kserve-container", **container}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": isvc["metadata"]["name"]}, "spec": spec}
