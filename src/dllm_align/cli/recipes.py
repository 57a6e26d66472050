"""``dllm-align recipes``: list, show and check the bundled recipes.

Only typer, the standard library, cli.app and the recipe schema are imported at module level; the rest
inside the command body, so that `dllm-align --help` loads neither torch nor transformers.
"""

from __future__ import annotations

import typer

from dllm_align.cli.app import Group, RecipeArg, SetOpt, app, command

group = typer.Typer(cls=Group, help="List, show and check recipes (bundled by name, or your own YAML).", no_args_is_help=True)
app.add_typer(group, name="recipes")


@command("list", group=group)
def list_recipes() -> None:
    """List the bundled recipes with their descriptions.

    Example: dllm-align recipes list
    """
    from dllm_align.config.recipe import bundled_dir, bundled_names, read_yaml
    from dllm_align.core.console import result

    for name in bundled_names():
        raw = read_yaml(bundled_dir() / f"{name}.yaml")
        desc = str(raw.get("description", "")).strip().splitlines()
        result(f"{name:<28} {desc[0] if desc else ''}")


@command("show", group=group)
def show(recipe: RecipeArg) -> None:
    """Print a recipe's YAML as shipped, ready to copy and edit.

    Example: dllm-align recipes show demo > my_recipe.yaml
    """
    from dllm_align.config.recipe import locate, read_yaml_text
    from dllm_align.core.console import result

    result(read_yaml_text(locate(recipe)))


@command("check", group=group)
def check(recipe: RecipeArg, set_: SetOpt = None) -> None:
    """Validate a recipe (with overrides) and print it fully resolved, defaults included.

    Example: dllm-align recipes check kto_mix_14k --set train.beta=0.2
    """
    from dllm_align.config.recipe import load_recipe, to_yaml
    from dllm_align.core.console import result

    rec = load_recipe(recipe, set_)
    if rec.model is not None:
        # the settings of the components the model decides (its family, its likelihood), as train checks them
        from dllm_align.training.plan import check_for_model

        check_for_model(rec)
    result(to_yaml(rec))
