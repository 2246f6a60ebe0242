"""Everything about what a job IS, in one package: its schema, sizes, checks, loading, the frozen spec and
its plan, and its preparation (the model, the task, the warm start). Nothing here imports the runtime, the
services, the server or the planner's state (only the planner's `JobPlan` record).

Modules, bottom to top (each imports only those above it in this list, and lower packages):

    construction  THE process-wide lock around building a torch model (a leaf)
    pretrained    real pretrained models shipped in packages, converted once into a local cache
    model_config  `ModelConfig`, `LoRAConfig`, `StrictModel` (the base of every config model)
    config        `JobConfig` and its sections: the schema
    checks        a validated job against its pipeline and the machine (chunks, slices, LoRA, vLLM, budget)
    load          `load_job`: YAML -> overrides -> `JobConfig` -> compiled pipeline -> checks (`LoadedJob`)
    tasks/        the generated tasks and the data-file task
    models        the locally built model and tokenizer, the warm start, the model cache
    budget        a job's device need from its config alone (a cluster's budget check)
    spec          `JobSpec` (frozen) and its plan, `JobRun` (the runner's record), `prepare_job`

Import the module you need (`from plexrl.job.load import load_job`); this package imports nothing, so that
`plexrl.job.construction` stays a leaf. What a job weighs (weights, state bytes by dtype, a LoRA adapter's
state) is `plexrl.sizes`, below the engines and services, which size with it too.
"""
