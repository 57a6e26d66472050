"""Foundation shared by every stage: user-facing errors (`errors`), stderr/stdout console and progress
(`console`), atomic files, locks and checksums (`io`), fault injection for the kill tests (`faults`) and the
run-folder records that say what a run was made with (`runfolder`).

May import: the standard library and third-party packages only; nothing else of dllm_align.
"""
