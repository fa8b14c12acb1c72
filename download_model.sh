#!/usr/bin/env bash
# Download a published DeepSeek V4 Flash GGUF (antirez/deepseek-v4-gguf on Hugging Face) into ./gguf/.
# Downloads go to <file>.part and are renamed when complete, so a finished name is always a whole file and an
# interrupted download resumes where it stopped when the same command is run again.
set -euo pipefail

Q2_FILE="DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf"
Q4_FILE="DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2.gguf"
MTP_FILE="DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf"
# The 0731 checkpoint (post-trained weights, same architecture), as antirez/deepseek-v4-gguf publishes it.
Q2_0731_FILE="DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf"
Q2_Q4_0731_FILE="DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-fixed-0731.gguf"
Q4_0731_FILE="DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix-0731.gguf"
MXFP4_0731_FILE="DeepSeek-V4-Flash-MXFP4Experts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-mxfp4-0731.gguf"
DSPARK_0731_FILE="DeepSeek-V4-Flash-DSpark-support-0731.gguf"
TARGETS="ds4f-q2 ds4f-q2-q4 ds4f-q4 ds4f-mxfp4 ds4f-dspark q2 q4 q2-imatrix q4-imatrix mtp"
MAIN_TARGETS=" ds4f-q2 ds4f-q2-q4 ds4f-q4 ds4f-mxfp4 q2 q4 q2-imatrix q4-imatrix "  # these repoint ./ds4flash.gguf

BASE_URL="${DS4_DOWNLOAD_BASE_URL:-https://huggingface.co/antirez/deepseek-v4-gguf/resolve/main}"
OUT_DIR="gguf"
LINK="ds4flash.gguf"

usage() {
    cat <<EOF
Usage: ./download_model.sh TARGET [--token TOKEN]

Downloads a DeepSeek V4 Flash GGUF from Hugging Face (antirez/deepseek-v4-gguf) into ./$OUT_DIR/.

Targets, the 0731 checkpoint (post-trained; today's files):
  ds4f-q2      2-bit routed experts (IQ2_XXS gate/up, Q2_K down), 86.7 GB: a 128 GB machine
  ds4f-q2-q4   the same with layers 37-42's experts in Q4_K, 97.6 GB: 128 GB, with less room for context
  ds4f-q4      4-bit routed experts (Q4_K), 164.6 GB: a 192 GB machine or more
  ds4f-mxfp4   MXFP4 routed experts (lossless from the released FP4 weights), 156.0 GB: 192 GB or more
  ds4f-dspark  the DSpark multi-token drafter for 0731, about 6 GB (not the main model)
The April preview checkpoint:
  q2           2-bit routed experts (IQ2_XXS gate/up, Q2_K down), about 81 GB
  q2-imatrix   the same layout, experts quantized with an importance matrix
  q4           4-bit routed experts (Q4_K), about 153 GB
  q4-imatrix   the same layout, experts quantized with an importance matrix
  mtp          the optional multi-token-prediction head, about 3.5 GB

Options:
  --token TOKEN  Hugging Face access token. Otherwise \$HF_TOKEN, otherwise the token that
                 'hf auth login' saved (\$HF_HOME/token, default ~/.cache/huggingface/token).
  -h, --help     Show this help.

A main-model download points ./$LINK at the file (ds4-mlx's default model path); mtp and ds4f-dspark do not.
An interrupted download resumes when the same command is run again.
Environment: DS4_DOWNLOAD_BASE_URL overrides the download location ($BASE_URL).
EOF
}

die() {
    echo "download_model.sh: $1" >&2
    exit "${2:-1}"
}

target=""
token="${HF_TOKEN:-}"
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --token)
            [ $# -ge 2 ] || die "--token needs a value" 2
            token="$2"
            shift 2
            ;;
        --token=*) token="${1#--token=}"; shift ;;
        -*) die "unknown option '$1' (see --help)" 2 ;;
        *)
            [ -z "$target" ] || die "one target at a time, got '$target' and '$1'" 2
            target="$1"
            shift
            ;;
    esac
done

case "$target" in
    q2) file="$Q2_FILE" ;;
    q4) file="$Q4_FILE" ;;
    q2-imatrix) file="${Q2_FILE%.gguf}-imatrix.gguf" ;;
    q4-imatrix) file="${Q4_FILE%.gguf}-imatrix.gguf" ;;
    mtp) file="$MTP_FILE" ;;
    ds4f-q2) file="$Q2_0731_FILE" ;;
    ds4f-q2-q4) file="$Q2_Q4_0731_FILE" ;;
    ds4f-q4) file="$Q4_0731_FILE" ;;
    ds4f-mxfp4) file="$MXFP4_0731_FILE" ;;
    ds4f-dspark) file="$DSPARK_0731_FILE" ;;
    "") usage >&2; die "no target given; expected one of: $TARGETS" 2 ;;
    *) die "unknown target '$target'; expected one of: $TARGETS" 2 ;;
esac

if [ -z "$token" ]; then
    token_file="${HF_TOKEN_PATH:-${HF_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/huggingface}/token}"
    if [ -s "$token_file" ]; then
        token="$(tr -d '[:space:]' < "$token_file")"
    fi
fi

links=false
case "$MAIN_TARGETS" in *" $target "*) links=true ;; esac

if $links && [ -e "$LINK" ] && [ ! -L "$LINK" ]; then
    die "./$LINK exists and is not a symlink; move it away so it can point at the download"
fi

out="$OUT_DIR/$file"
if [ -s "$out" ]; then
    echo "Already downloaded: $out"
else
    mkdir -p "$OUT_DIR"
    echo "Downloading $file"
    echo "from $BASE_URL"
    curl_args=(--location --fail --progress-bar --continue-at - --output "$out.part" "$BASE_URL/$file")
    if [ -n "$token" ]; then
        # The header goes through a config on stdin so the token never shows in the process list.
        printf 'header = "Authorization: Bearer %s"\n' "$token" | curl --config - "${curl_args[@]}" \
            || die "download of $file failed; run the same command again to resume"
    else
        curl "${curl_args[@]}" || die "download of $file failed; run the same command again to resume"
    fi
    mv "$out.part" "$out"
fi

if $links; then
    ln -sfn "$out" "$LINK"
    echo "./$LINK -> $out"
fi
echo "Done."
