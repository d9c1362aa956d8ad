# Sourced by launch/quickstart.sh and launch/quickstart_video.sh: what both print after their quality table.
#   report_memory_and_curves   the distillation runs' measured memory (<save>/memory.json; appended to
#                              $RUN_DIR/metrics.md) and the students' training curves ($RUN_DIR/curves.png, the
#                              50-step teacher's Frechet distance in $RUN_DIR/metrics.json as the reference line)
# Reads RUN_DIR, GUIDANCE and LORA_RANK (0: no LoRA student) from the sourcing script; its arguments are the
# students' folder suffixes (launch/quickstart.sh's SEEDS: "_seed<S>" each; none: the plain folders), the memory
# table reads the first.
report_memory_and_curves() {
    local suffixes=("$@") curves=() suffix label
    [ "${#suffixes[@]}" -gt 0 ] || suffixes=("")
    local memory=("DMD2 student, 4 steps (full weights)=$RUN_DIR/student_4step${suffixes[0]}")
    for suffix in "${suffixes[@]}"; do
        label="${suffix/_seed/ seed }"
        curves+=(--run "4-step$label=$RUN_DIR/student_4step$suffix" --run "1-step$label=$RUN_DIR/student_1step$suffix")
    done
    if [ "$LORA_RANK" -gt 0 ]; then
        memory+=("DMD2 LoRA student rank $LORA_RANK, 4 steps=$RUN_DIR/student_4step_lora")
        curves+=(--run "4-step LoRA rank $LORA_RANK=$RUN_DIR/student_4step_lora")
    fi
    echo "== measured memory of the distillation runs (this process's roles; <save>/memory.json)"
    python -m dmd2_mega.eval.memory_table "${memory[@]}" | tee -a "$RUN_DIR/metrics.md"
    echo "== training curves of the students (the 50-step teacher's Frechet distance as the reference)"
    python launch/plot_curves.py --out "$RUN_DIR/curves.png" "${curves[@]}" \
        --reference-json "$RUN_DIR/metrics.json:teacher, 50 Euler steps, CFG $GUIDANCE" \
        || echo "   curves not drawn (above: why; students trained before the curves were recorded have none)"
}
