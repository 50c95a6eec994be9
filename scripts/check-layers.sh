#!/usr/bin/env bash
# Checks the layer table of DESIGN.md: each folder includes only the folders below it.
#   include/troupe  the public API: nothing private
#   messages        include/
#   kernels         include/
#   actors          messages/, include/, and of kernels/ the device interface and the log
#                   (the named loggers, kernels/log.hpp, which model/ uses too); in it,
#                   actors/cluster/ (nodes, their gateway and leases, call links) is a floor
#                   of its own: the supervisor (executor, executor_system, where the
#                   workers start, supervisor_client, how the facade calls, supervisor,
#                   caller_unit, and worker_maker, where its replacements come from)
#                   uses it,
#                   and it uses only the workers' part of actors/ (worker_actor, teardown,
#                   linger, companion)
#   model           kernels/, include/
#   engine          include/, and of model/ the loaders (config, checkpoint, tokenizer, chat
#                   template)
#   server          include/
#   cli, tests, examples: anything
# Prints each upward include as file:line and exits 1 when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."

# folder | the include prefixes it may use besides its own folder
rules=(
  "include/troupe|troupe/"
  "messages|troupe/"
  "kernels|troupe/"
  "actors|messages/ troupe/ kernels/device.hpp kernels/log.hpp"
  "actors/cluster|actors/worker_actor.hpp actors/teardown.hpp actors/linger.hpp actors/companion.hpp messages/ troupe/ kernels/device.hpp kernels/log.hpp"
  "model|kernels/ troupe/"
  "engine|troupe/ model/config.hpp model/checkpoint.hpp model/tokenizer.hpp model/chat_template.hpp"
  "server|troupe/"
)

status=0
for rule in "${rules[@]}"; do
  folder=${rule%%|*}
  allowed="${folder#include/}/ ${rule#*|}"
  # A folder inside this one with a rule of its own is checked by that rule.
  inner=()
  for other in "${rules[@]}"; do
    sub=${other%%|*}
    [[ $sub == "$folder"/* ]] && inner+=(-path "$sub" -prune -o)
  done
  while IFS= read -r hit; do
    [[ -z $hit ]] && continue
    target=$(sed -E 's/.*#include *["<]([^">]+)[">].*/\1/' <<<"${hit#*:*:}")
    # An angle-bracket include is the project's only when it names one of its folders.
    [[ ${hit#*:*:} == *"<"* && ! $target =~ ^(troupe|messages|kernels|actors|model|engine|server|cli|tests)/ ]] &&
      continue
    ok=0
    for prefix in $allowed; do
      [[ $target == "$prefix"* ]] && ok=1 && break
    done
    if ((ok == 0)); then
      echo "upward include: ${hit%%:#*} includes \"$target\" (${folder}/ may include: $allowed)"
      status=1
    fi
  done < <(find "$folder" "${inner[@]}" -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' \
             -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' \) -print0 | sort -z |
             xargs -0 -r grep -Hn '^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]' || true)
done
# Of actors/, only the supervisor's files stand above actors/cluster/.
supervisor='^actors/(executor|executor_system|supervisor|supervisor_client|caller_unit|worker_maker)\.(hpp|cpp)$'
while IFS= read -r hit; do
  [[ -z $hit || ${hit%%:*} =~ $supervisor ]] && continue
  echo "upward include: ${hit%%:#*} includes actors/cluster/ (only the supervisor's files may)"
  status=1
done < <(find actors -maxdepth 1 -type f \( -name '*.hpp' -o -name '*.cpp' \) -print0 | sort -z |
           xargs -0 -r grep -Hn '^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]actors/cluster/' ||
           true)
if ((status == 0)); then
  echo "layers: every include points down"
fi
exit $status
