// Package bootstrapcheck checks the bootstrap the agent writes with Envoy's own types and
// validation, and merges a bootstrap override over it as Istio merges ISTIO_BOOTSTRAP_OVERRIDE.
// It links go-control-plane's bootstrap and everything it is made of, several megabytes: only
// the full meshid binary (and tests) import it, and hand Merge to the agent as its
// Envoy.CheckBootstrap; the slim meshid-agent leaves the override to Envoy.
package bootstrapcheck

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	// The types the bootstrap's typed_config fields name, and the TLS transport sockets an
	// override commonly adds: an Any resolves only to a type linked in the binary.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
	"sigs.k8s.io/yaml"

	"github.com/meshid/meshid/agent/envoy"
)

// Check parses bootstrap, JSON, into Envoy's Bootstrap, refusing a field Envoy does not know, and
// checks it with ValidateAll, and each typed_config (and other Any) with its own type's.
func Check(bootstrap []byte) error {
	_, err := parseBootstrap(bootstrap)
	return err
}

// Merge checks bootstrap as Check does and merges override, a Bootstrap in JSON or YAML, over it
// with proto.Merge (a scalar the override sets replaces the bootstrap's, a repeated field is
// appended to, a message is merged field by field: Istio's semantics), checks the result the
// same way and returns it as indented JSON, the same bytes for the same input. overridePath names
// the override in errors, which wrap envoy.ErrOverride when the override is at fault. With no
// override, bootstrap is returned as it is.
func Merge(bootstrap, override []byte, overridePath string) ([]byte, error) {
	b, err := parseBootstrap(bootstrap)
	if err != nil {
		return nil, err
	}
	if len(override) == 0 {
		return bootstrap, nil
	}
	o, err := parseOverride(override)
	if err != nil {
		return nil, overrideError{path: overridePath, err: err}
	}
	proto.Merge(b, o)
	if err := validate(b); err != nil {
		return nil, overrideError{path: overridePath, err: fmt.Errorf("merged over the bootstrap: %w", err)}
	}
	return marshal(b)
}

// parseBootstrap reads the bootstrap the agent wrote: a failure here is the agent's, not the
// user's.
func parseBootstrap(data []byte) (*bootstrapv3.Bootstrap, error) {
	var b bootstrapv3.Bootstrap
	if err := (protojson.UnmarshalOptions{}).Unmarshal(data, &b); err != nil {
		return nil, fmt.Errorf("the bootstrap is not Envoy's Bootstrap: %w", err)
	}
	if err := validate(&b); err != nil {
		return nil, fmt.Errorf("the bootstrap is invalid: %w", err)
	}
	return &b, nil
}

// overrideError is a refused override, naming its file; it wraps envoy.ErrOverride.
type overrideError struct {
	path string
	err  error
}

func (e overrideError) Error() string {
	return fmt.Sprintf("%s %s: %s", envoy.ErrOverride, e.path, e.err)
}

func (e overrideError) Unwrap() []error { return []error{envoy.ErrOverride, e.err} }

// validate checks b with ValidateAll, and the content of each of its Any fields (typed_config
// and the like) with its own type's, since ValidateAll does not look into an Any.
func validate(b *bootstrapv3.Bootstrap) error {
	if err := b.ValidateAll(); err != nil {
		return err
	}
	return validateFields(b.ProtoReflect(), "Bootstrap")
}

// validator is what go-control-plane's generated messages have.
type validator interface{ ValidateAll() error }

// validateFields checks every Any reachable from m; path names m in errors, with the fields'
// names as the file spells them.
func validateFields(m protoreflect.Message, path string) error {
	var errs []error
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		name := path + "." + string(fd.Name())
		switch {
		case fd.IsMap():
			if fd.MapValue().Message() == nil {
				return true
			}
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				errs = append(errs, validateMessage(mv.Message(), fmt.Sprintf("%s[%q]", name, k.String())))
				return true
			})
		case fd.IsList():
			if fd.Message() == nil {
				return true
			}
			for i := range v.List().Len() {
				errs = append(errs, validateMessage(v.List().Get(i).Message(), fmt.Sprintf("%s[%d]", name, i)))
			}
		case fd.Message() != nil:
			errs = append(errs, validateMessage(v.Message(), name))
		}
		return true
	})
	return errors.Join(errs...)
}

func validateMessage(m protoreflect.Message, path string) error {
	a, ok := m.Interface().(*anypb.Any)
	if !ok {
		return validateFields(m, path)
	}
	inner, err := a.UnmarshalNew()
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	path += "(" + string(inner.ProtoReflect().Descriptor().FullName()) + ")"
	if v, ok := inner.(validator); ok {
		if err := v.ValidateAll(); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	return validateFields(inner.ProtoReflect(), path)
}

// parseOverride reads a Bootstrap from JSON or YAML (read as JSON), refusing unknown fields.
// Its typed_config and other Any fields can name only the types linked in this binary.
func parseOverride(data []byte) (*bootstrapv3.Bootstrap, error) {
	jsonData := data
	yamlForm := !json.Valid(data)
	if yamlForm {
		var err error
		if jsonData, err = yaml.YAMLToJSON(data); err != nil {
			return nil, fmt.Errorf("neither JSON nor YAML: %w", err)
		}
	}
	var b bootstrapv3.Bootstrap
	if err := (protojson.UnmarshalOptions{}).Unmarshal(jsonData, &b); err != nil {
		if yamlForm {
			// protojson's positions are in the JSON the YAML was turned into.
			return nil, fmt.Errorf("%w (its line:column is in the file turned into JSON)", err)
		}
		return nil, err
	}
	return &b, nil
}

// marshal returns b as indented JSON, the same bytes for the same bootstrap: protojson orders
// fields and map keys but varies its whitespace on purpose, so it is indented again here.
func marshal(b *bootstrapv3.Bootstrap) ([]byte, error) {
	data, err := protojson.Marshal(b)
	if err != nil {
		return nil, fmt.Errorf("marshal bootstrap: %w", err)
	}
	var compact, out bytes.Buffer
	if err := json.Compact(&compact, data); err != nil {
		return nil, fmt.Errorf("compact bootstrap: %w", err)
	}
	if err := json.Indent(&out, compact.Bytes(), "", "  "); err != nil {
		return nil, fmt.Errorf("indent bootstrap: %w", err)
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}
