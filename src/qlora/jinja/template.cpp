// Running the parsed template: scopes as jinja2 has them (a for loop's body and a macro get their
// own; `if` does not), loop controls, the generation tracker, and the expression evaluator.
#include "qlora/jinja/template.h"

#include <cmath>
#include <ctime>

#include "qlora/jinja/eval.h"

namespace qlora::jinja {
namespace {

struct LoopBreak {};
struct LoopContinue {};

class Renderer {
 public:
  Renderer(const std::string& origin, const RenderOptions& options) : origin_(origin), options_(options) {}

  std::vector<Dict> scopes;
  Rendered out;

  void run(const Body& body) {
    for (const auto& s : body) exec(*s);
  }

  Value eval(const Expr& e);

 private:
  const std::string& origin_;
  const RenderOptions& options_;

  std::string at(Where w) const { return origin_ + ":" + std::to_string(w.line) + ":" + std::to_string(w.column); }
  [[noreturn]] void fail(Where w, const std::string& what) const { throw TemplateError(at(w) + ": " + what); }

  Value lookup(const std::string& name) const {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it)
      if (const Value* v = it->find(name)) return *v;
    return Value();
  }
  void exec(const Stmt& s);
  void exec_for(const Stmt& s);
  void exec_set(const Stmt& s);
  Value make_macro(const Stmt& s);
  Value attribute(const Value& obj, const std::string& name, Where w);
  Value index(const Value& obj, const Value& key, Where w);
  Value slice(const Expr& e);
  Value call(const Expr& e);
  Value binary(const Expr& e);
  Args eval_args(const Expr& e, size_t first);
};

void Renderer::exec(const Stmt& s) {
  switch (s.kind) {
    case Stmt::Kind::kText: out.text += s.text; return;
    case Stmt::Kind::kOutput: {
      const Value v = eval(*s.expr);
      out.text += v.to_str();
      return;
    }
    case Stmt::Kind::kIf:
      for (const auto& [cond, body] : s.branches)
        if (eval(*cond).truthy()) return run(body);
      return run(s.else_body);
    case Stmt::Kind::kFor: return exec_for(s);
    case Stmt::Kind::kSet: return exec_set(s);
    case Stmt::Kind::kMacro: scopes.back().set(s.text, make_macro(s)); return;
    case Stmt::Kind::kBreak: throw LoopBreak{};
    case Stmt::Kind::kContinue: throw LoopContinue{};
    case Stmt::Kind::kFilterBlock: {
      const size_t begin = out.text.size();
      run(s.body);
      const Value text(out.text.substr(begin));
      out.text.resize(begin);
      Args a = eval_args(*s.expr, 1);
      out.text += apply_filter(s.expr->name, text, a).to_str();
      return;
    }
    case Stmt::Kind::kGeneration: {
      const size_t begin = out.text.size();
      run(s.body);
      out.generation_spans.emplace_back(begin, out.text.size());
      return;
    }
  }
}

void Renderer::exec_for(const Stmt& s) {
  List items = iterate(eval(*s.expr), at(s.where));
  const auto bind = [&](Dict& scope, const Value& item) {
    if (s.targets.size() == 1) return scope.set(s.targets[0], item);
    const List parts = iterate(item, at(s.where));
    if (parts.size() != s.targets.size()) fail(s.where, "cannot unpack " + std::to_string(parts.size()) + " values into " +
                                                         std::to_string(s.targets.size()) + " loop variables");
    for (size_t k = 0; k < parts.size(); ++k) scope.set(s.targets[k], parts[k]);
  };
  if (s.filter) {  // the `if` of a for loop filters before loop.* counts
    List kept;
    for (const auto& item : items) {
      scopes.emplace_back();
      bind(scopes.back(), item);
      const bool keep = eval(*s.filter).truthy();
      scopes.pop_back();
      if (keep) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) return run(s.else_body);
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    Dict loop;
    loop.set("index", Value(i + 1));
    loop.set("index0", Value(i));
    loop.set("revindex", Value(n - i));
    loop.set("revindex0", Value(n - i - 1));
    loop.set("first", Value(i == 0));
    loop.set("last", Value(i == n - 1));
    loop.set("length", Value(n));
    loop.set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value());
    loop.set("nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value());
    loop.set("cycle", Value(Callable([i](Args& a) -> Value {
      if (a.positional.empty()) a.fail("loop.cycle needs at least one value");
      return a.positional[static_cast<size_t>(i) % a.positional.size()];
    })));
    scopes.emplace_back();
    scopes.back().set("loop", Value(std::move(loop)));
    bind(scopes.back(), items[static_cast<size_t>(i)]);
    try {
      run(s.body);
    } catch (const LoopBreak&) {
      scopes.pop_back();
      break;
    } catch (const LoopContinue&) {
    }
    scopes.pop_back();
  }
}

void Renderer::exec_set(const Stmt& s) {
  Value v;
  if (s.expr) {
    v = eval(*s.expr);
  } else {  // {% set x %}...{% endset %}: the block's output
    const size_t begin = out.text.size();
    run(s.body);
    v = Value(out.text.substr(begin));
    out.text.resize(begin);
  }
  if (!s.attr.empty()) {
    const Value ns = lookup(s.targets[0]);
    if (!ns.is_namespace()) fail(s.where, "cannot assign attribute '" + s.attr + "' on " + s.targets[0] + " (not a namespace)");
    ns.dict().set(s.attr, std::move(v));
    return;
  }
  if (s.targets.size() == 1) return scopes.back().set(s.targets[0], std::move(v));
  const List parts = iterate(v, at(s.where));
  if (parts.size() != s.targets.size()) fail(s.where, "cannot unpack " + std::to_string(parts.size()) + " values");
  for (size_t k = 0; k < parts.size(); ++k) scopes.back().set(s.targets[k], parts[k]);
}

Value Renderer::make_macro(const Stmt& s) {
  const Stmt* def = &s;
  return Value(Callable([this, def](Args& a) -> Value {
    Dict frame;
    if (a.positional.size() > def->params.size()) a.fail("macro '" + def->text + "' takes " +
                                                         std::to_string(def->params.size()) + " arguments");
    for (size_t k = 0; k < def->params.size(); ++k) {
      Value v = a.get(k, def->params[k].c_str());
      if (v.is_undefined() && def->defaults[k]) v = eval(*def->defaults[k]);
      frame.set(def->params[k], v);
    }
    // A macro sees the template's globals and its arguments, not the caller's loop variables.
    std::vector<Dict> saved;
    saved.swap(scopes);
    scopes.push_back(saved.front());
    scopes.push_back(std::move(frame));
    const size_t begin = out.text.size();
    try {
      run(def->body);
    } catch (...) {
      scopes.swap(saved);
      throw;
    }
    std::string text = out.text.substr(begin);
    out.text.resize(begin);
    scopes.swap(saved);
    return Value(std::move(text));
  }));
}

Value Renderer::attribute(const Value& obj, const std::string& name, Where w) {
  if (obj.is_dict()) {
    if (const Value* v = obj.dict().find(name)) return *v;
    if (!obj.is_namespace()) {
      if (Value m = bound_method(obj, name); !m.is_undefined()) return m;
    }
    return Value();
  }
  if (obj.is_undefined()) fail(w, "'" + name + "' of an undefined value");
  if (obj.is_none()) fail(w, "'None' has no attribute '" + name + "'");
  if (Value m = bound_method(obj, name); !m.is_undefined()) return m;
  return Value();
}

Value Renderer::index(const Value& obj, const Value& key, Where w) {
  if (obj.is_dict()) {
    if (!key.is_string()) return Value();
    const Value* v = obj.dict().find(key.str());
    return v ? *v : Value();
  }
  if (obj.is_list() || obj.is_string()) {
    if (!key.is_int()) {
      if (key.is_string() && obj.is_list()) return Value();
      fail(w, std::string("indices must be integers, not ") + key.type_name());
    }
    const int64_t n = obj.is_list() ? static_cast<int64_t>(obj.list().size()) : static_cast<int64_t>(obj.str().size());
    int64_t i = key.as_int();
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value();  // jinja2: an undefined, not an error
    return obj.is_list() ? obj.list()[static_cast<size_t>(i)] : Value(obj.str().substr(static_cast<size_t>(i), 1));
  }
  if (obj.is_undefined()) fail(w, "subscript of an undefined value");
  fail(w, std::string("'") + obj.type_name() + "' object is not subscriptable");
}

Value Renderer::slice(const Expr& e) {
  const Value obj = eval(*e.args[0]);
  const auto part = [&](size_t k) -> std::optional<int64_t> {
    if (!e.args[k]) return std::nullopt;
    const Value v = eval(*e.args[k]);
    if (v.is_none()) return std::nullopt;
    if (!v.is_int()) fail(e.where, "slice indices must be integers");
    return v.as_int();
  };
  const auto start = part(1), stop = part(2), step_opt = part(3);
  const int64_t step = step_opt.value_or(1);
  if (step == 0) fail(e.where, "slice step cannot be zero");
  if (!obj.is_list() && !obj.is_string()) fail(e.where, std::string("cannot slice a ") + obj.type_name());
  const int64_t n = obj.is_list() ? static_cast<int64_t>(obj.list().size()) : static_cast<int64_t>(obj.str().size());
  // Python's slice.indices().
  const auto clamp = [&](std::optional<int64_t> v, int64_t dflt, bool is_start) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + n : *v;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    (void)is_start;
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t b = clamp(start, step > 0 ? 0 : n - 1, true), end = clamp(stop, step > 0 ? n : -1, false);
  List items;
  std::string text;
  for (int64_t i = b; step > 0 ? i < end : i > end; i += step) {
    if (obj.is_list()) items.push_back(obj.list()[static_cast<size_t>(i)]);
    else text += obj.str()[static_cast<size_t>(i)];
  }
  return obj.is_list() ? Value(std::move(items)) : Value(std::move(text));
}

Args Renderer::eval_args(const Expr& e, size_t first) {
  Args a;
  a.where = at(e.where);
  const size_t n_kw = e.kwarg_names.size(), n_pos = e.args.size() - first - n_kw;
  for (size_t k = 0; k < n_pos; ++k) a.positional.push_back(eval(*e.args[first + k]));
  for (size_t k = 0; k < n_kw; ++k) a.keyword.emplace_back(e.kwarg_names[k], eval(*e.args[first + n_pos + k]));
  return a;
}

// The globals transformers gives every template (raise_exception, strftime_now) and jinja2's
// own (namespace, dict, range); the context's variables shadow them, as in jinja2.
Dict builtin_globals(const RenderOptions& options) {
  Dict g;
  g.set("raise_exception", Value(Callable([](Args& a) -> Value { throw RaisedError(a.where, a.get(0, "message").to_str()); })));
  g.set("strftime_now", Value(Callable([now = options.now_unix_seconds](Args& a) -> Value {
    const std::time_t t = now ? static_cast<std::time_t>(*now) : std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[256];
    const size_t len = std::strftime(buf, sizeof buf, a.get(0, "format").to_str().c_str(), &tm);
    return Value(std::string(buf, len));
  })));
  for (const char* name : {"namespace", "dict"}) {
    const bool ns = std::string(name) == "namespace";
    g.set(name, Value(Callable([ns](Args& a) -> Value {
      Dict d;
      if (!a.positional.empty()) {
        if (!a.positional[0].is_dict()) a.fail("namespace()/dict() take a mapping or keyword arguments");
        d = a.positional[0].dict();
      }
      for (auto& [k, v] : a.keyword) d.set(k, v);
      return Value(std::move(d), ns);
    })));
  }
  g.set("range", Value(Callable([](Args& a) -> Value {
    int64_t b = 0, end = 0, step = 1;
    const auto& p = a.positional;
    if (p.size() == 1) end = p[0].as_int();
    else if (p.size() >= 2) b = p[0].as_int(), end = p[1].as_int(), step = p.size() > 2 ? p[2].as_int() : 1;
    if (step == 0) a.fail("range() step must not be zero");
    List l;
    for (int64_t i = b; step > 0 ? i < end : i > end; i += step) l.push_back(Value(i));
    return Value(std::move(l));
  })));
  return g;
}

Value Renderer::call(const Expr& e) {
  const Expr& callee = *e.args[0];
  Args a = eval_args(e, 1);
  const Value f = eval(callee);
  if (f.is_callable()) return f.fn()(a);
  if (callee.op == Expr::Op::kName && f.is_undefined())
    fail(e.where, "'" + callee.name + "' is undefined (not a function qlora's chat-template interpreter knows)");
  fail(e.where, std::string("'") + f.type_name() + "' object is not callable");
}

Value Renderer::binary(const Expr& e) {
  const std::string& op = e.name;
  if (op == "and") {
    Value l = eval(*e.args[0]);
    return l.truthy() ? eval(*e.args[1]) : l;
  }
  if (op == "or") {
    Value l = eval(*e.args[0]);
    return l.truthy() ? l : eval(*e.args[1]);
  }
  const Value l = eval(*e.args[0]), r = eval(*e.args[1]);
  for (size_t k = 0; k < 2 && op != "==" && op != "!=" && op != "~"; ++k)
    if ((k ? r : l).is_undefined()) {
      if (e.args[k]->op == Expr::Op::kName) fail(e.where, "'" + e.args[k]->name + "' is undefined");
      if (e.args[k]->op == Expr::Op::kAttr) fail(e.where, "'dict object' has no attribute '" + e.args[k]->name + "'");
    }
  if (op == "~") return Value(l.to_str() + r.to_str());
  if (op == "==") return Value(l == r);
  if (op == "!=") return Value(!(l == r));
  if (op == "<") return Value(less_than(l, r, at(e.where)));
  if (op == ">") return Value(less_than(r, l, at(e.where)));
  if (op == "<=") return Value(!less_than(r, l, at(e.where)));
  if (op == ">=") return Value(!less_than(l, r, at(e.where)));
  if (op == "in" || op == "not in") {
    bool found = false;
    if (r.is_string()) {
      if (!l.is_string()) fail(e.where, "'in <string>' requires a string on the left");
      found = r.str().find(l.str()) != std::string::npos;
    } else if (r.is_list()) {
      found = std::find(r.list().begin(), r.list().end(), l) != r.list().end();
    } else if (r.is_dict()) {
      found = l.is_string() && r.dict().find(l.str()) != nullptr;
    } else if (!r.is_undefined()) {
      fail(e.where, std::string("argument of type '") + r.type_name() + "' is not iterable");
    }
    return Value(op == "in" ? found : !found);
  }
  if (op == "+" && l.is_string() && r.is_string()) return Value(l.str() + r.str());
  if (op == "+" && l.is_list() && r.is_list()) {
    List c = l.list();
    c.insert(c.end(), r.list().begin(), r.list().end());
    return Value(std::move(c));
  }
  if (op == "*" && l.is_string() && r.is_int()) {
    std::string s;
    for (int64_t k = 0; k < r.as_int(); ++k) s += l.str();
    return Value(s);
  }
  if (!l.is_number() || !r.is_number())
    fail(e.where, std::string("unsupported operand types for ") + op + ": '" + l.type_name() + "' and '" + r.type_name() + "'");
  const bool ints = l.is_int() && r.is_int();
  const double x = l.as_float(), y = r.as_float();
  if (op == "/") {
    if (y == 0) fail(e.where, "division by zero");
    return Value(x / y);
  }
  if (op == "//" || op == "%") {
    if (y == 0) fail(e.where, "integer division or modulo by zero");
    if (ints) {
      const int64_t a = l.as_int(), b = r.as_int();
      int64_t q = a / b;
      if ((a % b != 0) && ((a < 0) != (b < 0))) --q;  // Python floors
      return op == "//" ? Value(q) : Value(a - q * b);
    }
    const double q = std::floor(x / y);
    return op == "//" ? Value(q) : Value(x - q * y);
  }
  if (op == "**") return ints && r.as_int() >= 0 ? Value(static_cast<int64_t>(std::llround(std::pow(x, y)))) : Value(std::pow(x, y));
  if (ints) {
    const int64_t a = l.as_int(), b = r.as_int();
    return Value(op == "+" ? a + b : op == "-" ? a - b : a * b);
  }
  return Value(op == "+" ? x + y : op == "-" ? x - y : x * y);
}

Value Renderer::eval(const Expr& e) {
  switch (e.op) {
    case Expr::Op::kLiteral: return e.value;
    case Expr::Op::kName: return lookup(e.name);
    case Expr::Op::kList: {
      List l;
      for (const auto& a : e.args) l.push_back(eval(*a));
      return Value(std::move(l));
    }
    case Expr::Op::kDict: {
      Dict d;
      for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
        const Value key = eval(*e.args[k]);
        if (!key.is_string()) fail(e.where, "dict keys must be strings");
        d.set(key.str(), eval(*e.args[k + 1]));
      }
      return Value(std::move(d));
    }
    case Expr::Op::kAttr: return attribute(eval(*e.args[0]), e.name, e.where);
    case Expr::Op::kIndex: return index(eval(*e.args[0]), eval(*e.args[1]), e.where);
    case Expr::Op::kSlice: return slice(e);
    case Expr::Op::kCall: return call(e);
    case Expr::Op::kFilter: {
      const Value v = eval(*e.args[0]);
      Args a = eval_args(e, 1);
      return apply_filter(e.name, v, a);
    }
    case Expr::Op::kTest: {
      // `x is defined` must not fail on the undefined attribute of an undefined value.
      Value v;
      try {
        v = eval(*e.args[0]);
      } catch (const TemplateError&) {
        if (e.name != "defined" && e.name != "undefined") throw;
      }
      Args a = eval_args(e, 1);
      return Value(apply_test(e.name, v, a) != e.negate);
    }
    case Expr::Op::kUnary: {
      const Value v = eval(*e.args[0]);
      if (e.name == "not") return Value(!v.truthy());
      if (!v.is_number()) fail(e.where, std::string("bad operand type for unary ") + e.name + ": '" + v.type_name() + "'");
      if (e.name == "+") return v;
      return v.kind() == Value::Kind::kFloat ? Value(-v.as_float()) : Value(-v.as_int());
    }
    case Expr::Op::kBinary: return binary(e);
    case Expr::Op::kCondition:
      if (eval(*e.args[0]).truthy()) return eval(*e.args[1]);
      return e.args[2] ? eval(*e.args[2]) : Value();
  }
  return Value();
}

}  // namespace

Template Template::parse(std::string_view source, std::string origin) {
  Template t;
  t.origin_ = std::move(origin);
  t.body_ = std::make_shared<const std::vector<std::shared_ptr<const Stmt>>>(parse_template(std::string(source), t.origin_));
  return t;
}

Rendered Template::render(const nlohmann::ordered_json& context, const RenderOptions& options) const {
  Renderer r(origin_, options);
  r.scopes.push_back(builtin_globals(options));
  if (context.is_object())
    for (const auto& [k, v] : context.items()) r.scopes.back().set(k, Value::from_json(v));
  try {
    r.run(*body_);
  } catch (const LoopBreak&) {
    throw TemplateError(origin_ + ": break outside a loop");
  } catch (const LoopContinue&) {
    throw TemplateError(origin_ + ": continue outside a loop");
  }
  return std::move(r.out);
}

}  // namespace qlora::jinja
