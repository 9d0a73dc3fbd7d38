// Validate custom resources offline: node validate-crds.mjs < objects.json
//
// Input: a JSON array of objects: Gateway API kinds (HTTPRoute, Gateway, GRPCRoute,
// ReferenceGrant of gateway.networking.k8s.io/v1), KEDA's ScaledObject (keda.sh/v1alpha1) and
// Envoy Gateway's SecurityPolicy and BackendTrafficPolicy (gateway.envoyproxy.io/v1alpha1).
// Output: a JSON array, one {kind, name, ok, errors} per object.
// Exit code: 0 all valid, 1 some invalid, 2 bad input.
//
// Two checks per object:
//  1. the schema of @kubernetes-models/gateway-api, @kubernetes-models/keda or
//     @kubernetes-models/envoy-gateway (generated from the projects' CRDs: types, required fields,
//     enums, patterns, min/max, maxItems), through its ajv validator;
//  2. strict: no field the API does not define. The generated validators accept unknown fields,
//     and the API server would prune them silently, so a typo (`backendRef`) would vanish. The
//     defined fields are read from the package's TypeScript declarations (the flattened
//     `declare class` of each type).
// Not checked (the API server's CEL rules, x-kubernetes-validations): e.g. "port is required
// when the backendRef is a Service" and unique header names per match; the Python tests assert
// those on the rendered values.
import { readFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const modules = join(here, "node_modules");
// apiVersion -> [folder of its generated models, the kinds checked]
const APIS = {
  "gateway.networking.k8s.io/v1": [join(modules, "@kubernetes-models", "gateway-api", "gateway.networking.k8s.io", "v1"),
                                   ["HTTPRoute", "Gateway", "GRPCRoute", "ReferenceGrant"]],
  "keda.sh/v1alpha1": [join(modules, "@kubernetes-models", "keda", "keda.sh", "v1alpha1"), ["ScaledObject"]],
  "gateway.envoyproxy.io/v1alpha1": [
    join(modules, "@kubernetes-models", "envoy-gateway", "gateway.envoyproxy.io", "v1alpha1"),
    ["SecurityPolicy", "BackendTrafficPolicy"]],
};

// -- strict field check from the .d.ts declarations ---------------------------------------
const declCache = new Map();

function declaration(file) {
  // {props: Map(name -> {type, imports}), isObject} for one .d.ts file.
  if (declCache.has(file)) return declCache.get(file);
  const text = readFileSync(file, "utf8");
  const imports = new Map();
  for (const m of text.matchAll(/import \{ (\w+) \} from "([^"]+)";/g)) imports.set(m[1], m[2]);
  const cls = text.match(/export declare class \w+ extends Model<\w+>[^{]*\{\n([\s\S]*?)\n\}/);
  const props = new Map();
  if (cls) {
    let current = null;
    for (const line of cls[1].split("\n")) {
      const m = line.match(/^ {4}"([^"]+)"\??: (.*)$/);
      if (m) {
        current = m[1];
        props.set(current, m[2].replace(/;$/, ""));
      } else if (current && !/^ {4}\S/.test(line)) {
        props.set(current, props.get(current) + " " + line.trim());  // a multi-line inline type
      } else {
        current = null;  // constructor, static members
      }
    }
  }
  const decl = { props, imports, file, isObject: Boolean(cls) };
  declCache.set(file, decl);
  return decl;
}

function resolveImport(decl, spec) {
  const path = spec.startsWith(".") ? resolve(dirname(decl.file), spec) : join(modules, spec);
  return path.replace(/\.js$/, "") + ".d.ts";
}

function unknownFields(value, decl, path, out) {
  if (value === null || typeof value !== "object" || Array.isArray(value) || !decl.isObject) return;
  for (const [key, child] of Object.entries(value)) {
    if (!decl.props.has(key)) {
      out.push(`${path}/${key}: unknown field (defined: ${[...decl.props.keys()].join(", ")})`);
      continue;
    }
    const type = decl.props.get(key);
    if (type.startsWith("{")) continue;  // an inline map such as labels
    const ref = type.match(/I((?:IoK8s|ComGithub)\w+)/);
    if (!ref || !decl.imports.has(`I${ref[1]}`)) continue;  // a scalar or a literal union
    const next = declaration(resolveImport(decl, decl.imports.get(`I${ref[1]}`)));
    const items = type.startsWith("Array<") && Array.isArray(child) ? child : [child];
    items.forEach((item, i) => unknownFields(item, next, type.startsWith("Array<") ? `${path}/${key}/${i}` : `${path}/${key}`, out));
  }
}

// -- main ------------------------------------------------------------------------------------
let objects;
try {
  objects = JSON.parse(readFileSync(0, "utf8"));
  if (!Array.isArray(objects)) throw new Error("expected a JSON array of objects");
} catch (e) {
  console.error(`validate-crds: ${e.message}`);
  process.exit(2);
}

const results = [];
for (const obj of objects) {
  const kind = obj?.kind;
  const result = { kind, name: obj?.metadata?.name ?? null, ok: false, errors: [] };
  results.push(result);
  const [folder, kinds] = APIS[obj?.apiVersion] ?? [null, []];
  if (!kinds.includes(kind)) {
    const known = Object.entries(APIS).map(([api, [, ks]]) => `${api} ${ks.join(", ")}`).join("; ");
    result.errors.push(`apiVersion/kind ${obj?.apiVersion}/${kind}: not one of ${known}`);
    continue;
  }
  const mod = await import(join(folder, `${kind}.js`));
  try {
    new mod[kind](obj).validate();
  } catch (e) {
    result.errors.push(...String(e.message).split("\n").filter(Boolean));
  }
  unknownFields(obj, declaration(join(folder, `${kind}.d.ts`)), "", result.errors);
  result.ok = result.errors.length === 0;
}
process.stdout.write(JSON.stringify(results, null, 1) + "\n");
process.exit(results.every((r) => r.ok) ? 0 : 1);
